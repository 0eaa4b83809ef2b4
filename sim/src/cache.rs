//! One simulated rank's prefix cache: which full blocks of which prompts it holds, the engine
//! hashes it gives them, LRU eviction, and the KV events a vLLM engine core would emit for it.
//!
//! It owns the ground truth the indexer is measured against. Like vLLM's, a block's hash covers
//! its request's cache salt (first block) and the multimodal items overlapping it, so a salted or
//! multimodal prompt is a different block from the same tokens without. It never touches a socket
//! and never encodes anything: it produces `wire` events and answers questions about its own
//! content. With a CPU tier (`offload`), blocks GPU evicts are copied there first, as vLLM's
//! offloading connector does, and a prompt's blocks found there are loaded back into GPU. With a
//! sliding window (`window`), it is a hybrid rank: a full-attention group 0 and a sliding-window
//! group 1 in one block pool, scored as vLLM's hybrid coordinator scores them.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::rng::mix;
use kv_indexer::index::MmFeature;
use kv_indexer::wire::{BlockExtras, BlockRemoved, BlockStored, Event, MmPlacement, SpecKind};
use offload::CpuTier;
use window::Window;

mod offload;
mod window;

/// The medium every simulated block lives in.
const GPU: &str = "GPU";

/// What serving one prompt did to the cache.
#[derive(Clone, Debug, PartialEq)]
pub struct Served {
    /// Leading full blocks of the prompt that were cached before it ran.
    pub hit_blocks: u32,
    /// Evictions (one `BlockRemoved` per hash) then at most one `BlockStored` for the new run.
    pub events: Vec<Event>,
}

/// A request as the engine hashes it: the prompt, its cache salt and its multimodal items.
#[derive(Clone, Copy, Debug, Default)]
pub struct Request<'a> {
    pub tokens: &'a [u32],
    pub cache_salt: Option<&'a str>,
    pub mm_features: &'a [MmFeature],
}

impl<'a> From<&'a [u32]> for Request<'a> {
    fn from(tokens: &'a [u32]) -> Self {
        Request {
            tokens,
            ..Request::default()
        }
    }
}

impl<'a> From<&'a Vec<u32>> for Request<'a> {
    fn from(tokens: &'a Vec<u32>) -> Self {
        Request::from(tokens.as_slice())
    }
}

impl Request<'_> {
    /// What block `index` (of `block_size` tokens) hashes besides its tokens, as vLLM 0.33's
    /// `generate_block_hash_extra_keys`: the items overlapping it by offset, each with its offset
    /// from the block's first token, then the salt on the first block.
    fn block_extras(&self, index: usize, block_size: usize) -> BlockExtras {
        if self.mm_features.is_empty() && (self.cache_salt.is_none() || index > 0) {
            return BlockExtras::default();
        }
        let start = (index * block_size) as i64;
        let end = start + block_size as i64;
        let mut items: Vec<&MmFeature> = self.mm_features.iter().collect();
        items.sort_by_key(|item| item.offset);
        let mm_items = items
            .into_iter()
            .filter(|item| {
                let offset = i64::from(item.offset);
                offset < end && offset + i64::from(item.length) > start
            })
            .map(|item| MmPlacement {
                identifier: item.identifier.clone(),
                offset: i64::from(item.offset) - start,
            })
            .collect();
        BlockExtras {
            mm_items,
            cache_salt: self.cache_salt.filter(|_| index == 0).map(str::to_owned),
            ..BlockExtras::default()
        }
    }
}

struct CachedBlock {
    parent: Option<u64>,
    tokens: Vec<u32>,
    extras: BlockExtras,
    children: Vec<u64>,
    depth: u32,
    last_used: u64,
}

/// LRU order: oldest tick first and, within one tick, deepest block first. A parent is touched
/// whenever its child is (prompts are walked from the root), so a parent is never older than its
/// child and the first entry is always a leaf: evicting in this order never leaves a cached
/// block without its cached parent, and evicts the tails of prompts before their shared heads,
/// as vLLM's free-block queue does.
type LruKey = (u64, Reverse<u32>, u64);

/// Engine hashes are xxh3 digests, already uniform: hashing them again would only cost time.
#[derive(Default)]
struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, digest: u64) {
        self.0 = digest;
    }
}

type ByDigest<V> = HashMap<u64, V, BuildHasherDefault<DigestHasher>>;

/// One rank's prefix cache.
pub struct RankCache {
    block_size: u32,
    capacity: usize,
    seed: u64,
    blocks: ByDigest<CachedBlock>,
    lru: BTreeSet<LruKey>,
    tick: u64,
    cpu: Option<CpuTier>,
    /// A hybrid rank's sliding-window group; its blocks count against `capacity` too.
    window: Option<Window>,
    /// Every prompt's cached prefix is announced again (`BlockStored` of the blocks it reused),
    /// as an engine reporting reused blocks does (docs.md "Restarts").
    reports_reused: bool,
}

impl RankCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens (both at least 1) whose engine
    /// hashes depend on `seed`, as a vLLM process's hashes depend on its random per-process seed.
    pub fn new(block_size: u32, capacity: usize, seed: u64) -> Self {
        Self {
            block_size: block_size.max(1),
            capacity: capacity.max(1),
            seed,
            blocks: ByDigest::default(),
            lru: BTreeSet::new(),
            tick: 0,
            cpu: None,
            window: None,
            reports_reused: false,
        }
    }

    /// The same cache as a hybrid rank: group 1 a sliding window of `tokens` (not with a CPU
    /// tier). A prompt caches at most half the capacity: each block takes one in each group.
    pub fn with_sliding_window(mut self, tokens: u32) -> Self {
        self.window = Some(Window::new(tokens, self.block_size));
        self
    }

    /// Blocks of the sliding-window group (0 without one).
    pub fn window_len(&self) -> usize {
        self.window.as_ref().map_or(0, Window::len)
    }

    /// The same cache announcing every prompt's reused prefix again (plain ranks).
    pub fn reporting_reused(mut self) -> Self {
        self.reports_reused = true;
        self
    }

    /// The same cache with a CPU tier of `capacity` blocks that GPU offloads to.
    pub fn with_cpu_tier(mut self, capacity: usize) -> Self {
        self.cpu = Some(CpuTier::new(capacity));
        self
    }

    /// Number of blocks in the CPU tier (0 without one).
    pub fn cpu_len(&self) -> usize {
        self.cpu.as_ref().map_or(0, CpuTier::len)
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Runs a prompt: its leading cached blocks are hits and become most recently used; its other
    /// full blocks are cached, evicting least recently used blocks not used by this prompt. A
    /// prompt longer than the whole cache caches only its first `capacity` blocks.
    pub fn serve<'r>(&mut self, request: impl Into<Request<'r>>) -> Served {
        let request = request.into();
        if self.window.is_some() {
            return self.serve_hybrid(&request);
        }
        self.tick += 1;
        let cacheable: Vec<Block> = self.full_blocks(&request).take(self.capacity).collect();
        let mut parent = None;
        let mut hit_blocks = 0;
        for block in &cacheable {
            let hash = self.block_hash(parent, block);
            if !self.blocks.contains_key(&hash) {
                break;
            }
            self.touch(hash);
            parent = Some(hash);
            hit_blocks += 1;
        }
        let new_blocks = &cacheable[hit_blocks..];
        // Blocks the CPU tier has are loaded back into GPU rather than computed: the same GPU
        // store either way, and a use of the CPU copy.
        if self.cpu.is_some() {
            let mut parent = parent;
            for block in new_blocks {
                let hash = self.block_hash(parent, block);
                if let Some(cpu) = &mut self.cpu {
                    cpu.touch(hash, self.tick);
                }
                parent = Some(hash);
            }
        }
        let mut events = Vec::new();
        if self.reports_reused && hit_blocks > 0 {
            events.push(Event::Stored(self.reused_event(&cacheable[..hit_blocks])));
        }
        events.extend(self.evict(new_blocks.len()));
        if !new_blocks.is_empty() {
            events.push(Event::Stored(self.store(parent, hit_blocks, new_blocks)));
        }
        Served {
            hit_blocks: hit_blocks as u32,
            events,
        }
    }

    /// The store event that announces `reused`, a prompt's cached prefix, again.
    fn reused_event(&self, reused: &[Block]) -> BlockStored {
        let mut event = self.stored_event(None);
        let mut parent = None;
        for block in reused {
            let hash = self.block_hash(parent, block);
            event.block_hashes.push(hash);
            event.token_ids.extend_from_slice(block.tokens);
            event.extras.push(block.extras.clone());
            parent = Some(hash);
        }
        plain_unless_extras(event)
    }

    /// A hybrid rank's `serve`: group 0's run is reused and its other blocks computed as on a
    /// plain rank; the hit is the coordinator's; group 1 keeps the window its hit used and
    /// caches every later block it lacks, then frees the blocks the prefill left out of window.
    fn serve_hybrid(&mut self, request: &Request) -> Served {
        self.tick += 1;
        let tick = self.tick;
        let blocks: Vec<Block> = self.full_blocks(request).take(self.capacity / 2).collect();
        let hashes = self.chain(&blocks);
        let full_run = hashes
            .iter()
            .take_while(|hash| self.blocks.contains_key(hash))
            .count();
        for &hash in &hashes[..full_run] {
            self.touch(hash);
        }
        let Some(window) = self.window.as_mut() else {
            unreachable!("serve_hybrid runs with a window");
        };
        let hit = window.hit(&hashes, full_run);
        for i in window.used_by_hit(hit).chain(hit..hashes.len()) {
            window.touch(hashes[i], tick);
        }
        let window_new: Vec<usize> = (hit..hashes.len())
            .filter(|&i| !window.holds(hashes[i]))
            .collect();
        let mut events = self.evict(hashes.len() - full_run + window_new.len());
        if full_run < blocks.len() {
            let parent = full_run.checked_sub(1).map(|i| hashes[i]);
            events.push(Event::Stored(self.store(
                parent,
                full_run,
                &blocks[full_run..],
            )));
        }
        // Group 1's new blocks, one store per run, each chained from the block before it.
        let Some(window) = self.window.as_mut() else {
            unreachable!("serve_hybrid runs with a window");
        };
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for &i in &window_new {
            window.insert(hashes[i], i as u32, tick);
            match runs.last_mut() {
                Some(run) if run.end == i => run.end += 1,
                _ => runs.push(i..i + 1),
            }
        }
        window.free_out_of_window(&hashes, request.tokens.len(), self.block_size);
        for run in runs {
            let parent = run.start.checked_sub(1).map(|i| hashes[i]);
            let mut event = self.window_event(parent);
            for i in run {
                event.block_hashes.push(hashes[i]);
                event.token_ids.extend_from_slice(blocks[i].tokens);
                event.extras.push(blocks[i].extras.clone());
            }
            events.push(Event::Stored(plain_unless_extras(event)));
        }
        Served {
            hit_blocks: hit as u32,
            events,
        }
    }

    /// The engine hashes of a prompt's `blocks`, chained.
    fn chain(&self, blocks: &[Block]) -> Vec<u64> {
        let mut parent = None;
        blocks
            .iter()
            .map(|block| {
                let hash = self.block_hash(parent, block);
                parent = Some(hash);
                hash
            })
            .collect()
    }

    /// Ground truth: how many leading full blocks of `request` the engine would serve from its
    /// cache now (on a hybrid rank, what vLLM's coordinator computes). Does not count as a use.
    pub fn true_prefix_hit<'r>(&self, request: impl Into<Request<'r>>) -> u32 {
        let request = request.into();
        if let Some(window) = &self.window {
            let blocks: Vec<Block> = self.full_blocks(&request).collect();
            let hashes = self.chain(&blocks);
            let full_run = self.full_attention_run(request) as usize;
            return window.hit(&hashes, full_run) as u32;
        }
        let mut parent = None;
        let mut hits = 0;
        for block in self.full_blocks(&request) {
            let hash = self.block_hash(parent, &block);
            if !self.blocks.contains_key(&hash) {
                break;
            }
            parent = Some(hash);
            hits += 1;
        }
        hits
    }

    /// What group 0 (full attention) alone would serve: the leading full blocks it holds, which
    /// on a plain rank is the hit.
    pub fn full_attention_run<'r>(&self, request: impl Into<Request<'r>>) -> u32 {
        let request = request.into();
        let blocks: Vec<Block> = self.full_blocks(&request).collect();
        let hashes = self.chain(&blocks);
        hashes
            .iter()
            .take_while(|hash| self.blocks.contains_key(hash))
            .count() as u32
    }

    /// Ground truth per tier, cumulative as an engine loads a prefix: `[gpu, cpu, disk]` with
    /// `gpu` the leading blocks in GPU, `cpu` that plus the CPU tier's run from there on (there
    /// is no disk tier: `disk` equals `cpu`).
    pub fn true_tiers<'r>(&self, request: impl Into<Request<'r>>) -> [u32; 3] {
        let request = request.into();
        if self.window.is_some() {
            let hit = self.true_prefix_hit(request);
            return [hit; 3];
        }
        let mut parent = None;
        let hashes: Vec<u64> = self
            .full_blocks(&request)
            .map(|block| {
                let hash = self.block_hash(parent, &block);
                parent = Some(hash);
                hash
            })
            .collect();
        let gpu = hashes
            .iter()
            .take_while(|hash| self.blocks.contains_key(hash))
            .count();
        let in_cpu = |hash: &&u64| self.cpu.as_ref().is_some_and(|tier| tier.holds(**hash));
        let cpu = gpu + hashes[gpu..].iter().take_while(in_cpu).count();
        [gpu as u32, cpu as u32, cpu as u32]
    }

    /// Drops every GPU block, as vLLM's `/reset_prefix_cache`; the engine hashes stay the same.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
        if let Some(window) = &mut self.window {
            window.clear();
        }
    }

    /// A process restart: the cache (every tier) is empty and engine hashes come from a new
    /// seed.
    pub fn reset(&mut self) {
        self.clear();
        if let Some(cpu) = &mut self.cpu {
            cpu.clear();
        }
        self.seed = mix(self.seed, 0x5EED);
    }

    /// Every cached block as `BlockStored` events, one per unbranched root-to-fork run, every
    /// parent before its children.
    pub fn snapshot_events(&self) -> Vec<BlockStored> {
        let mut pending: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, block)| block.parent.is_none())
            .map(|(&hash, _)| hash)
            .collect();
        let mut events = Vec::new();
        while let Some(first) = pending.pop() {
            let Some(first_block) = self.blocks.get(&first) else {
                continue;
            };
            let mut event = self.stored_event(first_block.parent);
            let mut current = first;
            while let Some(block) = self.blocks.get(&current) {
                event.block_hashes.push(current);
                event.token_ids.extend_from_slice(&block.tokens);
                event.extras.push(block.extras.clone());
                match block.children.as_slice() {
                    [only] => current = *only,
                    forks => {
                        pending.extend_from_slice(forks);
                        break;
                    }
                }
            }
            events.push(plain_unless_extras(event));
        }
        // Group 1's blocks one by one, shallowest first: each one's parent is in group 0 (the
        // group evicts a block no later than group 0 does).
        for hash in self
            .window
            .as_ref()
            .map(Window::by_depth)
            .unwrap_or_default()
        {
            let Some(block) = self.blocks.get(&hash) else {
                continue;
            };
            let mut event = self.window_event(block.parent);
            event.block_hashes.push(hash);
            event.token_ids.extend_from_slice(&block.tokens);
            event.extras.push(block.extras.clone());
            events.push(plain_unless_extras(event));
        }
        events
    }

    fn full_blocks<'r>(&self, request: &Request<'r>) -> impl Iterator<Item = Block<'r>> + 'r {
        let block_size = self.block_size as usize;
        let request = *request;
        request
            .tokens
            .chunks_exact(block_size)
            .enumerate()
            .map(move |(index, tokens)| Block {
                tokens,
                extras: request.block_extras(index, block_size),
            })
    }

    /// The engine hash: chained over the parent's hash, covering the block's extras, and seeded
    /// per process, like vLLM's.
    fn block_hash(&self, parent: Option<u64>, block: &Block) -> u64 {
        let mut bytes = Vec::with_capacity(8 + 4 * block.tokens.len());
        if let Some(parent) = parent {
            bytes.extend_from_slice(&parent.to_le_bytes());
        }
        for token in block.tokens {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        for item in &block.extras.mm_items {
            bytes.extend_from_slice(item.identifier.as_bytes());
            bytes.extend_from_slice(&item.offset.to_le_bytes());
        }
        if let Some(salt) = &block.extras.cache_salt {
            bytes.extend_from_slice(salt.as_bytes());
        }
        xxh3_64_with_seed(&bytes, self.seed)
    }

    fn touch(&mut self, hash: u64) {
        let tick = self.tick;
        if let Some(block) = self.blocks.get_mut(&hash) {
            self.lru
                .remove(&(block.last_used, Reverse(block.depth), hash));
            block.last_used = tick;
            self.lru.insert((tick, Reverse(block.depth), hash));
        }
    }

    /// Frees room for `incoming` blocks, never evicting a block the current prompt uses. On a
    /// hybrid rank the pool is shared: group 1's next block goes first when it is freed out of
    /// window or no younger than group 0's (so group 1 never holds a block group 0 lacks).
    fn evict(&mut self, incoming: usize) -> Vec<Event> {
        let mut removed = Vec::new();
        while self.blocks.len() + self.window_len() + incoming > self.capacity {
            let oldest = self.lru.first().copied();
            if let Some(window) = &mut self.window {
                if let Some(key) = window.first() {
                    let (in_window, last_used, depth, hash) = key;
                    let before_group_0 = oldest.is_none_or(|(tick, deepest, _)| {
                        (in_window, last_used, depth) <= (true, tick, deepest)
                    });
                    if before_group_0 {
                        if in_window && last_used == self.tick {
                            break;
                        }
                        window.evict(key);
                        removed.push(Event::Removed(BlockRemoved {
                            block_hashes: vec![hash],
                            medium: Some(GPU.to_string()),
                            group_idx: Some(1),
                        }));
                        continue;
                    }
                }
            }
            let Some(oldest) = oldest else {
                break;
            };
            let (last_used, _, hash) = oldest;
            if last_used == self.tick {
                // Everything left is used by the running prompt; `serve` caps a prompt at the
                // capacity, so this only guards the invariant.
                break;
            }
            self.lru.remove(&oldest);
            if let Some(cpu) = &mut self.cpu {
                cpu.offload(hash, self.tick, &mut removed);
            }
            if let Some(block) = self.blocks.remove(&hash) {
                debug_assert!(block.children.is_empty(), "LRU order evicts leaves first");
                if let Some(parent) = block.parent.and_then(|p| self.blocks.get_mut(&p)) {
                    parent.children.retain(|&child| child != hash);
                }
            }
            removed.push(Event::Removed(BlockRemoved {
                block_hashes: vec![hash],
                medium: Some(GPU.to_string()),
                group_idx: Some(0),
            }));
        }
        removed
    }

    /// Caches `new_blocks` after `parent` (at depth `first_depth`) and describes them.
    fn store(
        &mut self,
        parent: Option<u64>,
        first_depth: usize,
        new_blocks: &[Block],
    ) -> BlockStored {
        let mut event = self.stored_event(parent);
        let mut parent = parent;
        for (offset, block) in new_blocks.iter().enumerate() {
            let hash = self.block_hash(parent, block);
            let depth = (first_depth + offset) as u32;
            self.blocks.insert(
                hash,
                CachedBlock {
                    parent,
                    tokens: block.tokens.to_vec(),
                    extras: block.extras.clone(),
                    children: Vec::new(),
                    depth,
                    last_used: self.tick,
                },
            );
            self.lru.insert((self.tick, Reverse(depth), hash));
            if let Some(parent_block) = parent.and_then(|p| self.blocks.get_mut(&p)) {
                parent_block.children.push(hash);
            }
            event.block_hashes.push(hash);
            event.token_ids.extend_from_slice(block.tokens);
            event.extras.push(block.extras.clone());
            parent = Some(hash);
        }
        plain_unless_extras(event)
    }

    /// An empty vLLM 0.33-style store event after `parent` (into group 0, which a hybrid rank's
    /// events name full attention).
    fn stored_event(&self, parent: Option<u64>) -> BlockStored {
        BlockStored {
            medium: Some(GPU.to_string()),
            group_idx: Some(0),
            kind: self.window.as_ref().map(|_| SpecKind::FullAttention),
            ..BlockStored::new(Vec::new(), parent, Vec::new(), self.block_size)
        }
    }

    /// The same into a hybrid rank's sliding-window group 1.
    fn window_event(&self, parent: Option<u64>) -> BlockStored {
        BlockStored {
            group_idx: Some(1),
            kind: Some(SpecKind::SlidingWindow),
            sliding_window: self.window.as_ref().map(Window::tokens),
            ..self.stored_event(parent)
        }
    }
}

/// One full block of a request: its tokens and what else its hash covers.
struct Block<'r> {
    tokens: &'r [u32],
    extras: BlockExtras,
}

/// vLLM sends `extra_keys` entries as nil for plain blocks: an event's extras list is empty
/// unless a block has some.
fn plain_unless_extras(mut event: BlockStored) -> BlockStored {
    if event.extras.iter().all(BlockExtras::is_plain) {
        event.extras.clear();
    }
    event
}

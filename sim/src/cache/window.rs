//! A hybrid rank's sliding-window KV-cache group (group 1 beside the full-attention group 0), as
//! vLLM 0.33 keeps one: its blocks share group 0's engine hashes and the rank's block pool;
//! blocks that fall out of the window while a prompt's prefill runs are freed at once and are the
//! first evicted; a prompt's hit is what vLLM's `HybridKVCacheCoordinator` computes.
//!
//! It owns the group's part of the ground truth and of the events. It never touches a socket and
//! never encodes anything.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::ByDigest;

/// Eviction order inside the group: blocks freed out of window first, then by use like group 0.
/// `(in_use, last_used, Reverse(depth), hash)`.
pub(super) type WindowKey = (bool, u64, Reverse<u32>, u64);

struct WindowBlock {
    depth: u32,
    last_used: u64,
    in_use: bool,
}

pub(super) struct Window {
    /// The window in tokens.
    tokens: u32,
    /// Blocks before a hit point whose cache a hit needs: `ceil((window - 1) / block_size)`, at
    /// least 1.
    needed: usize,
    blocks: ByDigest<WindowBlock>,
    lru: BTreeSet<WindowKey>,
}

impl Window {
    pub(super) fn new(tokens: u32, block_size: u32) -> Window {
        Window {
            tokens: tokens.max(1),
            needed: (tokens.saturating_sub(1).div_ceil(block_size) as usize).max(1),
            blocks: ByDigest::default(),
            lru: BTreeSet::new(),
        }
    }

    pub(super) fn tokens(&self) -> u32 {
        self.tokens
    }

    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(super) fn holds(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// vLLM's `SlidingWindowManager.find_longest_cache_hit` over the prompt's chain `hashes`, at
    /// most `bound` blocks (group 0's run): scanning down for `needed` consecutive held blocks,
    /// else the run held from the start.
    pub(super) fn hit(&self, hashes: &[u64], bound: usize) -> usize {
        let mut contiguous = 0;
        for i in (0..bound).rev() {
            if self.holds(hashes[i]) {
                contiguous += 1;
                if contiguous >= self.needed {
                    return i + self.needed;
                }
            } else {
                contiguous = 0;
            }
        }
        contiguous
    }

    /// The blocks a hit of `hit` blocks uses (the last `needed` before it): the others are null
    /// blocks in vLLM's request, not touched.
    pub(super) fn used_by_hit(&self, hit: usize) -> std::ops::Range<usize> {
        hit.saturating_sub(self.needed)..hit
    }

    fn rekey(&mut self, hash: u64, change: impl FnOnce(&mut WindowBlock)) {
        if let Some(block) = self.blocks.get_mut(&hash) {
            self.lru
                .remove(&(block.in_use, block.last_used, Reverse(block.depth), hash));
            change(block);
            self.lru
                .insert((block.in_use, block.last_used, Reverse(block.depth), hash));
        }
    }

    pub(super) fn touch(&mut self, hash: u64, tick: u64) {
        self.rekey(hash, |block| {
            block.last_used = tick;
            block.in_use = true;
        });
    }

    pub(super) fn insert(&mut self, hash: u64, depth: u32, tick: u64) {
        self.blocks.insert(
            hash,
            WindowBlock {
                depth,
                last_used: tick,
                in_use: true,
            },
        );
        self.lru.insert((true, tick, Reverse(depth), hash));
    }

    /// vLLM frees a running prompt's blocks that fall out of the window: after a prefill of
    /// `tokens`, every block below `(tokens - window + 1) / block_size`; they stay cached, first
    /// in line for eviction.
    pub(super) fn free_out_of_window(&mut self, hashes: &[u64], tokens: usize, block_size: u32) {
        let skipped = (tokens + 1).saturating_sub(self.tokens as usize) / block_size as usize;
        for &hash in &hashes[..skipped.min(hashes.len())] {
            self.rekey(hash, |block| block.in_use = false);
        }
    }

    /// The next block to evict, with its place in the order.
    pub(super) fn first(&self) -> Option<WindowKey> {
        self.lru.first().copied()
    }

    pub(super) fn evict(&mut self, key: WindowKey) {
        self.lru.remove(&key);
        self.blocks.remove(&key.3);
    }

    pub(super) fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
    }

    /// Held hashes, shallowest first.
    pub(super) fn by_depth(&self) -> Vec<u64> {
        let mut held: Vec<(u32, u64)> = self
            .blocks
            .iter()
            .map(|(&hash, block)| (block.depth, hash))
            .collect();
        held.sort_unstable();
        held.into_iter().map(|(_, hash)| hash).collect()
    }
}
